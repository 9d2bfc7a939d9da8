"""0006-kvcli-release-copied-weights: a weight llama.cpp copies out of the model's mapping into a buffer of its own
(the CPU's repacked layout) leaves none of its file pages resident in the process once the model is loaded, and the
model computes from the copy. Linux only (/proc/self/pagemap)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = textwrap.dedent('''
    import io, json, os, re, struct, sys
    import gguf
    import numpy as np
    from kvcli.engines import open_native
    path = sys.argv[1]
    os.environ["KVCLI_DEBUG"] = "1"          # llama.cpp's log, which names each tensor it repacks
    log, sys.stderr = io.StringIO(), io.StringIO()
    s = open_native(path, n_ctx=512, n_seq=1, n_threads=2)
    log = sys.stderr.getvalue(); sys.stderr = sys.__stderr__
    os.environ.pop("KVCLI_DEBUG")
    copied = sorted(set(re.findall(r"repack tensor (\\S+) with", log)))
    r = gguf.GGUFReader(path)
    ranges = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in r.tensors if t.name in copied}
    del r
    name = os.path.basename(path)
    maps = [l.split() for l in open("/proc/self/maps") if l.rstrip().endswith(name)]
    def present(off, n):
        pages = 0
        with open("/proc/self/pagemap", "rb") as f:
            for m in maps:
                lo, hi = (int(x, 16) for x in m[0].split("-")); base = lo - int(m[2], 16)
                a, b = max(lo, (base + off + 4095) & ~4095), min(hi, (base + off + n) & ~4095)
                for p in range(a // 4096, b // 4096):
                    f.seek(p * 8); pages += struct.unpack("Q", f.read(8))[0] >> 63
        return pages
    at_load = {k: present(*v) for k, v in ranges.items()}
    s.prefill(s.tokenize("The weights are read from their copy."), seq=0)
    print(json.dumps({"copied": copied, "present_at_load": at_load,
                      "whole_pages": {k: (o + n) // 4096 - (o + 4095) // 4096 for k, (o, n) in ranges.items()},
                      "finite": bool(np.isfinite(s.logits(0)).all())}))
''')


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux's /proc/self/pagemap")
def test_weights_copied_out_of_the_mapping_leave_no_file_pages_resident(tmp_path):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    # q4_0 matrices of 36 pages (64 x 4096): llama.cpp repacks them for the CPU (AVX2, NEON) into its own buffer
    model = write_tiny_llama(tmp_path / "q4.gguf", n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=4096,
                             dtype="q4_0", seed=3)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = subprocess.run([sys.executable, str(probe), str(model)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if not res["copied"]:
        pytest.skip("llama.cpp repacks no q4_0 weight on this CPU")
    assert sum(res["whole_pages"].values()) > 0
    # right after the load none of a copied weight's whole file pages is mapped in (later reads of a neighbouring
    # weight may map back pages of a large folio the two share: the kernel's, not a read of the copied weight)
    assert res["present_at_load"] == {k: 0 for k in res["copied"]}
    assert res["finite"]
