"""Pictures of what megalite knows as numbers: pipeline timelines (``timeline``), memory per GPU (``memory``), runs'
metrics side by side (``metrics``). Drawing needs matplotlib, an optional extra (``pip install -e ".[plot]"``); the
numbers behind each figure (a simulated or recorded timeline and its bubble, the bars' segments, the largest
difference between runs) need nothing beyond the standard library, so they are tested without it. Training never
imports this package (tests/test_layers.py checks that nothing outside it imports matplotlib).

The entry points are ``tools/plot_schedule.py``, ``tools/plot_metrics.py``, ``tools/plan_parallelism.py --plot`` and
``pretrain_gpt.py --dry-run --plot``.
"""
