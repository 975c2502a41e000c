"""Evaluations on the trained twins: approximation quality, passkey retrieval,
perplexity. Each module has ``add_<name>_args(parser)`` / ``run_<name>(args)``
for the ``entmaxkv`` CLI and a ``main()`` for ``python -m entmaxkv.eval.<name>``."""
