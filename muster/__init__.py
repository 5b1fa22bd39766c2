"""Muster: elastic rendezvous and heartbeat coordinator for PyTorch distributed training."""
