"""Backends that execute a Strategy (torch.distributed, collaborative training, MindSpore export)."""
