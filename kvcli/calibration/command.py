"""kvcli calibrate compresskv: the offline step of CompressKV, its result in a GGUF side-car; kvcli calibrate show.

The policy's `calibrate` hook (kvcli/policies/compresskv.py) names this module: kvcli/commands/calibrate.py adds
its COMMANDS to the `kvcli calibrate` group, kvcli info says UNCALIBRATED of a model without one. A command (it takes
the shared flags of kvcli/commands/options.py): in the commands layer (tests/test_architecture.py)."""
from __future__ import annotations

import json

import click

from kvcli.calibration import store
from kvcli.calibration.store import rank_heads
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.errors import KvcliError
from kvcli.models import resolve_model
from kvcli.policies.compresskv import SPEC, allocate


def parse_lengths(text: str | None) -> tuple[int, ...]:
    """'512,1k,2k' -> (512, 1024, 2048)."""
    if not text:
        return ()
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item, 10))
        except ValueError:
            raise KvcliError(f"--lengths expects comma-separated token counts like 512,1k,2k (bad item '{item}')") \
                from None
    if not out:
        raise KvcliError("--lengths is empty")
    return tuple(sorted(set(out)))


# what kvcli info says of a model without a calibration
UNCALIBRATED = "compresskv falls back to all-head scoring and uniform budgets"


@click.command("compresskv")
@model_option
@click.option("--out", "-o", "out", default=None, metavar="OUT.kvcal.gguf",
              help="Where to write the side-car. Default: <model>.kvcal.gguf next to the model, where "
                   "--policy compresskv finds it (the user cache if that folder is read-only).")
@click.option("--lengths", default=None, metavar="N,N,...",
              help="Probe prompt lengths in tokens (e.g. 512,1k,2k,4k). Default: doubling from 512 up to the "
                   "model's context, at most 4k.")
@click.option("--depths", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Needle depths per length, spread from the start to the end of the haystack.")
@click.option("--needles", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Different needles per (length, depth).")
@click.option("--samples", type=click.IntRange(1, 1000), default=4, show_default=True,
              help="Texts for the layer error profile (their lengths cycle through --lengths).")
@click.option("--gen-tokens", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Decoding steps per error-profile text.")
@click.option("--max-new-tokens", type=click.IntRange(1, 256), default=24, show_default=True,
              help="Answer length limit per probe.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated texts and needles.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@request_options("threads", threads_help="CPU threads of torch (the calibration runs the reference engine). "
                 "Default: torch's own.")
@json_option
def compresskv_cmd(req: Request, model, out, lengths, depths, needles, samples, gen_tokens, max_new_tokens, seed,
                   quiet, as_json):
    """Find the semantic retrieval heads and the layer error profile of a model (CompressKV's offline step).

    Runs needle-in-a-haystack probes and calibration texts (generated locally) through the reference
    engine. Progress is saved after every probe: an interrupted run (Ctrl-C) resumes when started
    again with the same settings. Prints the side-car's path on stdout (or --json)."""
    from kvcli.reference import require as require_reference  # noqa: PLC0415 (torch: pip install 'kvcli[reference]')
    require_reference()
    from kvcli.calibration.compresskv import Settings, calibrate  # noqa: PLC0415

    path = resolve_model(model)
    s = Settings(lengths=parse_lengths(lengths), depths=depths, needles=needles, samples=samples,
                 gen_tokens=gen_tokens, max_new_tokens=max_new_tokens, seed=seed)
    if req.threads:
        import torch  # noqa: PLC0415
        torch.set_num_threads(req.threads)
    warn = (lambda msg: None) if quiet else (lambda msg: click.echo(f"kvcli: {msg}", err=True))
    try:
        cal = calibrate(path, out, s, progress=not quiet, warn=warn)
    except KeyboardInterrupt:
        click.echo("kvcli: calibration interrupted; progress is saved: run the same command again to resume",
                   err=True)
        raise
    if as_json:
        click.echo(json.dumps(cal.as_json()))
    else:
        click.echo(cal.source)
    if not quiet and not as_json:
        click.echo(describe(cal), err=True)


@click.command("show")
@click.argument("model", required=False)
@click.option("--budget", "-b", type=click.IntRange(1, 1 << 20), default=256, show_default=True,
              help="Show the per-layer budgets compresskv gives at this --budget.")
@click.option("--plot", metavar="PNG", default=None, help="Write a heat-map of the head scores per layer.")
@json_option
def show_cmd(model, budget, plot, as_json):
    """Show the compresskv calibration kvcli finds for MODEL (default: the default model)."""
    if plot:
        from kvcli.evaluation.report import require_matplotlib  # noqa: PLC0415
        require_matplotlib()
    path = resolve_model(model)
    cal = store.find(path)
    if cal is None:
        raise KvcliError(f"no compresskv calibration for {path}: run kvcli calibrate compresskv --model {path}")
    if plot:
        heatmap(cal, plot)
    if as_json:
        click.echo(json.dumps(cal.as_json()))
    else:
        click.echo(describe(cal, budget))


def heatmap(cal, png: str) -> None:
    """Head scores per layer as an image: rows = layers, columns = query heads, top-k marked."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    k = min(4, cal.n_head)
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * cal.n_head, 1.0 + 0.22 * cal.n_layer))
    im = ax.imshow(cal.head_scores, aspect="auto", cmap="viridis", interpolation="nearest")
    if cal.probes_ok:
        for l, row in enumerate(rank_heads(cal.head_scores)[:, :k]):
            for h in row:
                ax.text(h, l, "*", ha="center", va="center", color="white", fontsize=8)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(cal.n_head))
    ax.set_yticks(range(0, cal.n_layer, max(1, cal.n_layer // 15)))
    ax.set_title(f"{cal.model_name}: semantic retrieval score\n(* = top {k} per layer, {cal.probes_ok}/"
                 f"{cal.probes} probes)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.08, label="span attention, summed over answer steps")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def describe(cal, budget: int = 256) -> str:
    """A few lines: heads per layer, layer budgets at `budget`, how long it took."""
    p = SPEC.defaults()
    k = min(p["srh_k"], cal.n_head)
    lines = [f"compresskv calibration of {cal.model_name}: {cal.probes_ok}/{cal.probes} probes answered, "
             f"{cal.seconds / 60:.1f} min, written to {cal.source}"]
    if cal.probes_ok:
        srh = cal.srh(k)
        lines.append(f"semantic retrieval heads (top {k} per layer): " +
                     " ".join(f"{l}:{','.join(map(str, srh[l * k:(l + 1) * k]))}" for l in range(cal.n_layer)))
    b = allocate(list(cal.layer_scores), budget, p["min_budget"], p["max_factor"], p["allocator"])
    lines.append(f"layer budgets at --budget {budget}: {' '.join(map(str, b))}")
    return "\n".join(lines)


COMMANDS = [compresskv_cmd, show_cmd]   # added to the `kvcli calibrate` group
