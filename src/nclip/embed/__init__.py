"""``nclip embed`` and ``nclip search``: a dataset's zero-shot embeddings in float16 ``.npy`` shards with
one metadata file, a Faiss index and a manifest, and the ranked search over them (docs/embed.md).

Modules: :mod:`~nclip.embed.sources` (the rows of a data spec), :mod:`~nclip.embed.manifest` (the
directory's files and the settings a rerun must match), :mod:`~nclip.embed.writer` (the resumable
embedding loop, :func:`~nclip.embed.writer.embed`), :mod:`~nclip.embed.index` (``nclip.Index``: the
Faiss index and queries), :mod:`~nclip.embed.command` (the two subcommands). Importing this package
loads no torch."""
