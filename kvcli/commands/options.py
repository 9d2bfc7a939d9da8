"""Options several commands share."""
from __future__ import annotations

import click

model_option = click.option("--model", "-m", metavar="PATH.gguf", default=None,
                            help="GGUF model (llama architecture). Default: $KVCLI_MODEL, else the bundled "
                                 "SmolLM2-135M-Instruct Q4_1.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
