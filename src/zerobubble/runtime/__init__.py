"""Running one stage and one instruction on torch: B/W split, stages, p2p, the interpreter."""
