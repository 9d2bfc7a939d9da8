"""User defaults: environment variables and an optional config file; command-line flags win.

Order, first found wins: the flag, then the environment variable, then the config file, then
kvcli's built-in default.

    KVCLI_MODEL, KVCLI_POLICY, KVCLI_BUDGET,        environment variables
    KVCLI_STORE_MAX_BYTES, KVCLI_STORE_EXPIRY_HOURS
    $KVCLI_CONFIG, else $XDG_CONFIG_HOME/kvcli/config.toml (default ~/.config/kvcli/config.toml)

The config file is TOML with any of these top-level keys:

    model = "~/models/llama-3.2-1b.Q4_K_M.gguf"
    policy = "snapkv"
    budget = 256
    max_tokens = 512
    temperature = 0.0
    system = "Answer in one short paragraph."
    store_max_bytes = 10737418240     # the stored documents' cap (KVCLI_STORE_MAX_BYTES; `kvcli documents`)
    store_expiry_hours = 24           # unused temporary and partial stores expire (KVCLI_STORE_EXPIRY_HOURS)
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path

from kvcli.errors import KvcliError

# key -> (type, environment variable or None)
KEYS: dict[str, tuple[type, str | None]] = {
    "model": (str, "KVCLI_MODEL"),
    "policy": (str, "KVCLI_POLICY"),
    "budget": (int, "KVCLI_BUDGET"),
    "max_tokens": (int, None),
    "temperature": (float, None),
    "system": (str, None),
    "store_max_bytes": (int, "KVCLI_STORE_MAX_BYTES"),         # the document store's cap (kvcli/document_store.py)
    "store_expiry_hours": (float, "KVCLI_STORE_EXPIRY_HOURS"),  # unused temporary/partial stores go after this
}


def config_path() -> Path:
    if os.environ.get("KVCLI_CONFIG"):
        return Path(os.environ["KVCLI_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvcli" / "config.toml"


_TYPE_NAMES = {str: "a string", int: "a positive integer", float: "a number"}


def _check_type(key: str, value, where: str):
    typ = KEYS[key][0]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or isinstance(value, bool) or (typ is int and value <= 0):
        raise KvcliError(f"{where}: '{key}' must be {_TYPE_NAMES[typ]}, got {value!r}")
    return value


def read_file(path: Path | None = None) -> dict:
    """The config file's values (empty when there is none), checked key by key."""
    path = path or config_path()
    if not path.exists():
        if os.environ.get("KVCLI_CONFIG"):  # named explicitly: a missing file is a mistake
            raise KvcliError(f"config file not found: {path} (from KVCLI_CONFIG)")
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KvcliError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise KvcliError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise KvcliError(f"config file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise KvcliError(f"config file {path}: unknown key '{unknown[0]}' (known: {', '.join(KEYS)})")
    return {k: _check_type(k, v, f"config file {path}") for k, v in data.items()}


def _from_env(key: str):
    var = KEYS[key][1]
    raw = os.environ.get(var) if var else None
    if raw is None or not raw.strip():
        return None
    typ = KEYS[key][0]
    if typ is str:
        return raw
    try:
        value = typ(raw)
    except ValueError:
        raise KvcliError(f"{var}={raw!r} is not {_TYPE_NAMES[typ]}") from None
    return _check_type(key, value, var)


def get(key: str, default=None):
    """The user's default for `key`: environment, then config file, then `default`."""
    if key not in KEYS:
        raise KeyError(key)
    value = _from_env(key)
    if value is not None:
        return value
    value = read_file().get(key)
    if value is None:
        return default
    if key == "model":
        value = str(Path(value).expanduser())
    return value


def default(key: str, fallback=None):
    """A click `default=` callable, evaluated when the command line is parsed."""
    return lambda: get(key, fallback)


def sources() -> dict:
    """Where each configured value comes from, for `kvcli info`-style reports and tests."""
    out = {}
    file_vals = read_file()
    for key, (_, var) in KEYS.items():
        if var and os.environ.get(var, "").strip():
            out[key] = var
        elif key in file_vals:
            out[key] = str(config_path())
    return out


def env_bytes(name: str, default: int) -> int:
    """A size in MiB from the environment variable `name` (a number >= 0), in bytes; `default` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:   # also NaN
        raise KvcliError(f"{name} must be a number of MiB >= 0 (got {raw!r})")
    return int(mb * (1 << 20))
