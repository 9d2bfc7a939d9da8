"""kvcli policies: what each policy does, its parameters, paper and deviations."""
from __future__ import annotations

import json

import click

from kvcli import policies
from kvcli.commands.options import json_option


@click.command("policies")
@click.option("--explain", "explain", metavar="NAME", default=None,
              help="Parameters, defaults, paper and every documented deviation of one policy.")
@json_option
def policies_cmd(explain, as_json):
    """List the KV-cache policies (one line each), or explain one."""
    if as_json:
        names = [explain] if explain else policies.available()
        out = []
        for n in names:
            spec = policies.get(n)
            out.append({"name": spec.name, "summary": spec.summary, "needs": list(spec.needs),
                        "native": spec.native, "reference": spec.reference,
                        "params": {p.name: p.default for p in spec.params},
                        "deviations": list(spec.deviations)})
        click.echo(json.dumps(out, indent=2, default=str))
    elif explain:
        click.echo(policies.explain_text(explain))
    else:
        click.echo(policies.list_text())


COMMANDS = [policies_cmd]
