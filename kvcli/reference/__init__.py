"""The reference engine: the same GGUF in PyTorch/transformers, every policy written again in torch.

It exists to be read and to prove the native engine right (`kvcli check`):
- model.py      loads the GGUF with transformers (float32, CPU), once per process;
- attention.py  the attention function: slot bias, causality by original position, observation capture;
- compact.py    applies a Plan (docs/internals.md) to the cache;
- session.py    ReferenceSession, the session API both engines share;
- policies/     the torch planners, one readable file per policy.

Every module here needs torch and transformers, which only `pip install 'kvcli[reference]'` installs (the native
engine needs neither): importing this package without them raises the one-line KvcliError of `require()`.
"""
from kvcli.errors import KvcliError

INSTALL_HINT = "pip install 'kvcli[reference]'"


def require() -> None:
    """Raise a one-line KvcliError (exit 2) naming the install line unless torch and transformers import."""
    try:
        import torch  # noqa: F401, PLC0415
        import transformers  # noqa: F401, PLC0415
    except ImportError as e:
        missing = e.name or str(e)
        raise KvcliError(f"the reference engine needs torch and transformers ({missing} is not installed): "
                         f"{INSTALL_HINT}") from None


require()
