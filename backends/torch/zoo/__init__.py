"""The zoo: models and parallelization recipes to trace (written as ordinary
PyTorch), and the adapters that run torchtitan, transformers and
Megatron-Core models parallelized by those libraries themselves, with the CPU
shims they need (docs/torch-backend.md, "Modules"). Nothing outside the zoo
imports it but the command line's defaults, tests and scripts."""
