"""Entry points (``attnlab-train``, ``-eval``, ``-generate``, ``-translate``): thin Hydra mains."""
