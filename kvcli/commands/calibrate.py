"""kvcli calibrate: the offline steps policies need, run once per model, their results kept beside the model.

A policy with such a step names the module of its commands in its `calibrate` hook (kvcli.policies.base.PolicySpec);
its COMMANDS join this group (its calibration step under the policy's name, `show`)."""
from __future__ import annotations

import importlib

import click

from kvcli import policies


@click.group("calibrate")
def calibrate_group():
    """Offline calibration a policy needs, stored next to the model (kvcli info shows it)."""


for _spec in policies.REGISTRY.values():
    if _spec.calibrate is not None:
        for _cmd in importlib.import_module(_spec.calibrate).COMMANDS:
            calibrate_group.add_command(_cmd)


COMMANDS = [calibrate_group]
