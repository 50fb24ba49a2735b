"""One container for data prepared once and read as training goes (``attnlab-prepare``): a folder
(local, or at an ``s3://``, ``gs://`` or ``https://`` URL: ``attnlab.data.remote``) of shards and a
``manifest.json`` that names its ``kind`` and lists each split's shards with their counts and the
sha256 of each of their files.

- ``writer``: the atomic writer (``<out>.partial`` moved into place with its manifest last, a
  ``flock`` against a second writer, one line for a full disk) and ``ShardWriter``, one split's
  shards rolled over and hashed;
- ``folder``: ``ShardFolder``, the reader: the manifest of the kind asked for, every file inside
  the folder and of its size, each file's sha256 (and token ids below the vocabulary) checked once
  per process as it is first read;
- ``tar``: shards of records in webdataset's tar layout, written byte-reproducibly and streamed.

What a record is belongs to the kinds: ``tokens`` (``data.text.shards``), ``documents``
(``data.text.document_shards``), ``pairs`` (``data.text.pair_shards``), ``images``
(``data.vision.shards``), ``image_text`` (``data.multimodal.image_text_shards``).
"""
