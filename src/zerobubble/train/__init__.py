"""The end-to-end job: profile a model, plan a schedule for it, train, and measure."""
