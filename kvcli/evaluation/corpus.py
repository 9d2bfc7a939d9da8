"""A corpus of real documents nobody here wrote, assembled at eval time from installed Debian packages (issue #63).

Every document is text a Debian package ships, taken as the package ships it: manual pages (rendered by man-db
to plain text), the Python documentation's reStructuredText sources, the Debian Policy Manual and the GNU coding
standards as plain text, the licences of /usr/share/common-licenses, books of the King James Bible (public domain,
printed by the `bible` program of bible-kjv) and ISO code tables (iso-codes' JSON written as tab-separated rows).
Nothing is downloaded: `build_corpus` reads what is installed and stops, naming the packages, when a source is
missing. The packages the base system lacks are installed by one explicit command, `INSTALL_COMMAND`.

Four genres (`GENRES`): technical manuals, legal text, narrative prose, reference/tabular. Each document is put
in the tuning part or the held-out part by a fixed rule (`split_of`: within a genre, sorted by the sha256 of its
id, every third document from the second on is held out), recorded in the manifest, so no default is tuned on
the held-out part.

The folder written holds one `<id>.txt` per document and `manifest.json`: per document its genre, source
(package, version, path or command), licence, format (how its section headings are written, for the structure
questions of kvcli/evaluation/questions.py), tokens (of the tokenizer named in the manifest), characters, sha256
of the text and split.
"""
from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvcli.errors import KvcliError

GENRES = ("technical", "legal", "narrative", "reference")
SPLITS = ("tune", "heldout")
MANIFEST = "manifest.json"
PYDOC = "/usr/share/doc/python3.11/html/_sources"
# The packages the corpus needs that a Debian 12 base system (and this project's set-up) does not install.
EXTRA_PACKAGES = ("bible-kjv", "bible-kjv-text", "python3.11-doc", "debian-policy", "gnu-standards")
INSTALL_COMMAND = "apt-get install -y --no-install-recommends " + " ".join(EXTRA_PACKAGES)

LICENCES = {
    "manpages": "various verbatim-copying licences of the Linux man-pages project (see its copyright file)",
    "manpages-dev": "various verbatim-copying licences of the Linux man-pages project (see its copyright file)",
    "bash": "GPL-3+", "git-man": "GPL-2", "curl": "curl (MIT/X derivative)", "findutils": "GPL-3+",
    "openssh-client": "BSD-2-clause and others (OpenSSH)", "python3.11-doc": "PSF-2.0 (Python documentation)",
    "debian-policy": "GPL-2+ (Debian Policy Manual)", "gnu-standards": "GFDL-1.3+ (verbatim copying permitted)",
    "base-files": "the licence text itself: verbatim copies permitted, changing it is not allowed",
    "bible-kjv-text": "public domain (King James Version text)", "iso-codes": "LGPL-2.1+", "netbase": "GPL-2",
    "tzdata": "public domain (tz database)",
}


@dataclass(frozen=True)
class Source:
    """One document: how to get its text from an installed package."""
    id: str
    genre: str
    package: str
    kind: str            # man | file | kjv | iso-json
    arg: str             # man: "SECTION PAGE"; file: a path (.gz read as gzip); kjv: verse ranges (space between);
    #                      iso-json: a path
    format: str          # how headings are written: man | underline | kjv | legal | table
    title: str = ""
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def _man(i, section, page, package, genre="technical"):
    return Source(i, genre, package, "man", f"{section} {page}", "man", f"{page}({section}) manual page")


def _py(i, rel, title):
    return Source(i, "technical", "python3.11-doc", "file", f"{PYDOC}/{rel}.rst.txt", "underline",
                  f"Python 3.11 documentation: {title}")


def _lic(name):
    return Source(f"licence-{name.lower()}", "legal", "base-files", "file", f"/usr/share/common-licenses/{name}",
                  "legal", f"{name} licence text")


def _kjv(i, spec, title):
    return Source(f"kjv-{i}", "narrative", "bible-kjv-text", "kjv", spec, "kjv", f"King James Bible: {title}")


def _iso(i, name, title):
    return Source(f"iso-{i}", "reference", "iso-codes", "iso-json", f"/usr/share/iso-codes/json/{name}.json", "table",
                  title)


SOURCES: tuple[Source, ...] = (
    # technical manuals
    _man("man-tcp", 7, "tcp", "manpages"), _man("man-signal", 7, "signal", "manpages"),
    _man("man-capabilities", 7, "capabilities", "manpages"), _man("man-cgroups", 7, "cgroups", "manpages"),
    _man("man-proc", 5, "proc", "manpages"), _man("man-ptrace", 2, "ptrace", "manpages-dev"),
    _man("man-fcntl", 2, "fcntl", "manpages-dev"), _man("man-find", 1, "find", "findutils"),
    _man("man-ssh-config", 5, "ssh_config", "openssh-client"), _man("man-bash", 1, "bash", "bash"),
    _man("man-git-config", 1, "git-config", "git-man"), _man("man-git-rebase", 1, "git-rebase", "git-man"),
    _man("man-curl", 1, "curl", "curl"),
    _py("py-argparse", "library/argparse", "argparse"), _py("py-re", "library/re", "re"),
    _py("py-tutorial-classes", "tutorial/classes", "tutorial, Classes"),
    _py("py-howto-regex", "howto/regex", "Regular Expression HOWTO"),
    _py("py-stdtypes", "library/stdtypes", "Built-in Types"), _py("py-datamodel", "reference/datamodel", "Data model"),
    Source("gnu-coding-standards", "technical", "gnu-standards", "file",
           "/usr/share/doc/gnu-standards/standards.text.gz", "underline", "GNU Coding Standards"),
    Source("debian-policy", "technical", "debian-policy", "file", "/usr/share/doc/debian-policy/policy.txt.gz",
           "underline", "Debian Policy Manual"),
    Source("debian-upgrading-checklist", "technical", "debian-policy", "file",
           "/usr/share/doc/debian-policy/upgrading-checklist.txt.gz", "underline", "Debian Policy upgrading checklist"),
    # legal text
    _lic("GPL-3"), _lic("GPL-2"), _lic("LGPL-2.1"), _lic("GFDL-1.3"), _lic("GFDL-1.2"), _lic("MPL-2.0"),
    _lic("MPL-1.1"), _lic("Apache-2.0"),
    Source("py-license", "legal", "python3.11-doc", "file", f"{PYDOC}/license.rst.txt", "underline",
           "Python 3.11: history and licence terms"),
    # narrative prose
    _kjv("ruth", "Ruth1:1-4:22", "Ruth"), _kjv("esther", "Esther1:1-10:3", "Esther"),
    _kjv("jonah-micah", "Jonah1:1-Micah7:20", "Jonah and Micah"), _kjv("daniel", "Daniel1:1-12:13", "Daniel"),
    _kjv("mark", "Mark1:1-16:20", "Mark"), _kjv("judges", "Judges1:1-21:25", "Judges"),
    _kjv("luke-acts", "Luke1:1-24:53 Acts1:1-28:31", "Luke and Acts (one author's two volumes)"),
    _kjv("samuel", "1Samuel1:1-2Samuel24:25", "1 and 2 Samuel (one book in the Hebrew Bible)"),
    _kjv("genesis", "Genesis1:1-50:26", "Genesis"), _kjv("jeremiah", "Jeremiah1:1-52:34", "Jeremiah"),
    # reference / tabular
    Source("etc-services", "reference", "netbase", "file", "/etc/services", "table",
           "Network services, Internet style (/etc/services)"),
    _iso("4217", "iso_4217", "ISO 4217 currency codes"), _iso("639-2", "iso_639-2", "ISO 639-2 language codes"),
    _iso("3166-1", "iso_3166-1", "ISO 3166-1 country codes"), _iso("15924", "iso_15924", "ISO 15924 script codes"),
    _iso("3166-2", "iso_3166-2", "ISO 3166-2 subdivision codes"),
    _man("man-errno", 3, "errno", "manpages-dev", "reference"), _man("man-hier", 7, "hier", "manpages", "reference"),
    Source("tz-zone1970", "reference", "tzdata", "file", "/usr/share/zoneinfo/zone1970.tab", "table",
           "tz database: zones since 1970 (zone1970.tab)"),
    Source("py-codecs", "reference", "python3.11-doc", "file", f"{PYDOC}/library/codecs.rst.txt", "underline",
           "Python 3.11 documentation: codecs (with the standard encodings' tables)"),
)


# ------------------------------------------------------------------------------ reading the sources
def package_version(package: str) -> str | None:
    """The installed version of a Debian package, or None."""
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}\t${Version}", package], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or "\t" not in r.stdout:
        return None
    status, version = r.stdout.split("\t", 1)
    return version if status.endswith(" installed") else None


def normalise(text: str) -> str:
    """Plain text as written: overstrike and terminal escapes removed, trailing blanks stripped, runs of blank
    lines cut to one, one final newline."""
    text = re.sub(r".\x08", "", text)
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    out, blank = [], False
    for ln in lines:
        if not ln:
            if not blank and out:
                out.append("")
            blank = True
            continue
        blank = False
        out.append(ln)
    return "\n".join(out).strip("\n") + "\n"


def _run(cmd: list[str], env: dict | None = None) -> str:
    exe = shutil.which(cmd[0])
    if exe is None:
        raise KvcliError(f"'{cmd[0]}' is not installed: the corpus needs it ({INSTALL_COMMAND})")
    r = subprocess.run([exe, *cmd[1:]], capture_output=True, env={**os.environ, **(env or {})}, timeout=300)
    if r.returncode != 0 or not r.stdout.strip():
        raise KvcliError(f"'{' '.join(cmd)}' failed ({r.returncode}): {r.stderr.decode('utf-8', 'replace')[:200]}")
    return r.stdout.decode("utf-8", "replace")


def _table(path: str) -> str:
    """An iso-codes JSON file as tab-separated rows under a header line of its field names."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    (key, rows), = data.items()
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    lines = [f"ISO {key}", "", "\t".join(fields)]
    lines += ["\t".join(str(r.get(k, "")) for k in fields) for r in rows]
    return "\n".join(lines)


def read_source(src: Source) -> str:
    """The source's text, normalised; KvcliError when it cannot be read."""
    if src.kind == "man":
        section, page = src.arg.split()
        text = _run(["man", "-E", "UTF-8", "-P", "cat", section, page],
                    {"MANWIDTH": "80", "MANROFFOPT": "-rHY=0", "MAN_KEEP_FORMATTING": "", "GROFF_NO_SGR": "1",
                     "LANG": "C.UTF-8"})
    elif src.kind == "kjv":
        text = _run(["bible", "-l80", *src.arg.split()], {"LANG": "C.UTF-8"})
    elif src.kind == "iso-json":
        text = _table(src.arg)
    elif src.kind == "file":
        p = Path(src.arg)
        if not p.is_file():
            raise KvcliError(f"{src.id}: {p} is missing (package {src.package})")
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        text = raw.decode("utf-8", "replace")
    else:
        raise KvcliError(f"{src.id}: unknown source kind {src.kind}")
    return normalise(text)


def source_command(src: Source) -> str:
    """How the text was produced, for the manifest."""
    return {"man": f"MANWIDTH=80 MANROFFOPT=-rHY=0 man -E UTF-8 -P cat {src.arg}", "kjv": f"bible -l80 {src.arg}",
            "iso-json": f"{src.arg} as tab-separated rows"}.get(src.kind, src.arg)


def split_of(sources) -> dict[str, str]:
    """id -> 'tune' or 'heldout': within each genre, sorted by sha256(id), every third from the second on is held
    out. Depends on the ids alone, so adding a document to one genre moves no other genre's documents."""
    out = {}
    for g in {s.genre for s in sources}:
        ids = sorted((s.id for s in sources if s.genre == g), key=lambda i: hashlib.sha256(i.encode()).hexdigest())
        for k, i in enumerate(ids):
            out[i] = "heldout" if k % 3 == 1 else "tune"
    return out


def missing_sources(sources=SOURCES) -> list[str]:
    """The packages of `sources` that are not installed."""
    return sorted({s.package for s in sources if package_version(s.package) is None})


# ------------------------------------------------------------------------------ building
def build_corpus(out_dir, count_tokens=None, tokenizer: str | None = None, sources=SOURCES, only=None,
                 log=None) -> dict:
    """Write every source's text to out_dir/<id>.txt and the manifest; returns the manifest.

    count_tokens(text) -> int counts tokens (the manifest names `tokenizer`); None leaves tokens out. `only`: ids
    or genres to build (default: all). Stops before writing anything when a source's package is missing."""
    log = log or (lambda m: None)
    sel = [s for s in sources if not only or s.id in only or s.genre in only]
    if only:
        unknown = set(only) - {s.id for s in sources} - set(GENRES)
        if unknown:
            raise KvcliError(f"unknown corpus document or genre: {', '.join(sorted(unknown))}")
    missing = missing_sources(sel)
    if missing:
        raise KvcliError(f"the corpus needs Debian packages that are not installed: {', '.join(missing)}. "
                         f"Install them with: {INSTALL_COMMAND}")
    split = split_of(sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = []
    for s in sel:
        text = read_source(s)
        path = out / f"{s.id}.txt"
        path.write_text(text, encoding="utf-8")
        rec = {"id": s.id, "file": path.name, "title": s.title, "genre": s.genre, "split": split[s.id],
               "format": s.format,
               "source": {"package": s.package, "version": package_version(s.package), "from": source_command(s)},
               "licence": LICENCES.get(s.package, "see /usr/share/doc/" + s.package + "/copyright"),
               "chars": len(text), "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
        if count_tokens is not None:
            rec["tokens"] = int(count_tokens(text))
        docs.append(rec)
        log(f"{s.id}: {s.genre}, {rec.get('tokens', len(text))} {'tokens' if count_tokens else 'chars'}")
    manifest = {"corpus": "kvcli real text (issue #63)", "version": 1,
                "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "tokenizer": tokenizer, "install": INSTALL_COMMAND,
                "split_rule": "within each genre, ids sorted by sha256(id); every third from the second on is held out",
                "documents": docs}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def load_manifest(corpus_dir) -> dict:
    p = Path(corpus_dir) / MANIFEST
    if not p.is_file():
        raise KvcliError(f"{corpus_dir}: no {MANIFEST} (build the corpus with: kvcli eval corpus build --out DIR)")
    return json.loads(p.read_text(encoding="utf-8"))


def select(manifest: dict, split: str | None = None, genres=None, ids=None, min_tokens: int | None = None,
           max_tokens: int | None = None) -> list[dict]:
    """The manifest's documents that match every filter given (token filters need a manifest with tokens)."""
    out = []
    for d in manifest["documents"]:
        if split and split != "all" and d["split"] != split:
            continue
        if genres and d["genre"] not in genres:
            continue
        if ids and d["id"] not in ids:
            continue
        if (min_tokens or max_tokens) and "tokens" not in d:
            raise KvcliError("the corpus manifest has no token counts: build it with --model")
        if min_tokens and d["tokens"] < min_tokens or max_tokens and d["tokens"] > max_tokens:
            continue
        out.append(d)
    return out


def verify(corpus_dir, docs: list[dict]) -> None:
    """Each document's file is there and has the sha256 the manifest gives."""
    for d in docs:
        p = Path(corpus_dir) / d["file"]
        if not p.is_file():
            raise KvcliError(f"{p} is missing: build the corpus again")
        if hashlib.sha256(p.read_bytes()).hexdigest() != d["sha256"]:
            raise KvcliError(f"{p} differs from the manifest's sha256: build the corpus again")


@dataclass
class CorpusDoc:
    name: str
    text: str


def corpus_documents(corpus_dir, split: str = "tune", genres: str | None = None, max_tokens: int | None = None,
                     docs: str | None = None, min_tokens: int | None = None) -> tuple[list[CorpusDoc], dict]:
    """The corpus's documents an eval command reads: the `split` part, filtered by comma-separated `genres`,
    `min_tokens`, `max_tokens` and `docs` (ids), each checked against the manifest's sha256. Returns (documents,
    id -> the manifest's genre, split and tokens)."""
    manifest = load_manifest(corpus_dir)
    ids = [p.strip() for p in docs.split(",") if p.strip()] if docs else None
    gs = [g.strip() for g in genres.split(",") if g.strip()] if genres else None
    for g in gs or ():
        if g not in GENRES:
            raise KvcliError(f"--genres: unknown genre '{g}' (choose from {', '.join(GENRES)})")
    chosen = select(manifest, split, gs, ids, min_tokens=min_tokens, max_tokens=max_tokens)
    if ids:   # in the order given, so a run stopped early has the documents asked for first
        chosen.sort(key=lambda d: ids.index(d["id"]))
        unknown = set(ids) - {d["id"] for d in chosen}
        if unknown:
            raise KvcliError(f"--docs: not in the corpus's {split} part (or filtered out): "
                             f"{', '.join(sorted(unknown))}")
    if not chosen:
        raise KvcliError(f"no document of the corpus in {corpus_dir} matches the filters")
    verify(corpus_dir, chosen)
    meta = {d["id"]: {k: d[k] for k in ("genre", "split", "tokens") if k in d} for d in chosen}
    return [CorpusDoc(d["id"], (Path(corpus_dir) / d["file"]).read_text(encoding="utf-8")) for d in chosen], meta


def length_bucket(tokens: int) -> str:
    for hi, name in ((4096, "<4k"), (32768, "4k-32k"), (65536, "32k-64k"), (131072, "64k-128k")):
        if tokens < hi:
            return name
    return ">=128k"
