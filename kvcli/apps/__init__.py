"""Apps: what the commands run, built on the drivers.

`pipeline` (one document, one or more questions: `kvcli run`), `chat` (a conversation over a document),
`batch` (a corpus through one shared cache) and `batch_ray` (the same on a Ray cluster).
"""
