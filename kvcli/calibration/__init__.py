"""Offline calibration of policies that need per-model data (CompressKV), stored in GGUF side-cars.

    kvcli.calibration.compresskv.calibrate(model_path, out, settings)   -> Calibration (writes the side-car)
    kvcli.calibration.store.find(model_path)                            -> Calibration | None (checked)
    kvcli.calibration.lookup.policy_args(model_path, args)               -> compresskv --policy-arg dict

Modules: probes (texts and needles), runner (torch model + attention hooks), heads (semantic
retrieval heads), layers (error profile), store (GGUF side-car), compresskv (the whole run).
"""
