"""Bridges to other libraries: PyTorch pipelining's schedules, Hugging Face models.

They import torch (schedule/ never does); ``hf`` imports ``transformers`` only when called.
"""
