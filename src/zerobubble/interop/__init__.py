"""Bridges to other pipeline libraries (they import torch; schedule/ never does)."""
