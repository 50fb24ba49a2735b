"""Data prepared once (``attnlab-prepare``) and read as training goes: a folder (local or a URL) of
shards and a ``manifest.json`` naming its ``kind`` (tokens, documents, pairs, images, image_text)
and each split's shards with their counts and sha256. ``writer``: the atomic writer; ``folder``:
the checked reader; ``tar``: webdataset tar shards, written reproducibly and streamed."""
