"""The reference engine: the same GGUF in PyTorch/transformers, every policy written again in torch.

It exists to be read and to prove the native engine right (`kvcli check`):
- model.py      loads the GGUF with transformers (float32, CPU), once per process;
- attention.py  the attention function: slot bias, causality by original position, observation capture;
- compact.py    applies a Plan (docs/internals.md) to the cache;
- session.py    ReferenceSession, the session API both engines share;
- policies/     the torch planners, one readable file per policy.
"""
