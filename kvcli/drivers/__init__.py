"""Drivers: what reads a document into a session and compresses it, on top of planning.

`compress` (one prefill, then the plan), `chunked` (bounded reading in chunks), `reselect` (a document's
stored full cache, re-selected per question), `lockstep` (many sequences decoded in one context), and their
callers `bench` and `check`. The apps (kvcli/apps) and kvcli/evaluation build on these.
"""
