"""Sequence segments on the runtime: cutting a batch, the K/V kept between segments, the check."""
