"""Verify real PyTorch parallelism: trace DTensor, FSDP2 and pipelining steps per rank
and lower them into plans (docs/torch-backend.md)."""
