"""Synthetic data that needs no files: procedural meshes (:mod:`.meshes`), a box mesh built with
Pillow only (:mod:`.pillow_box`) and small RGB-D scenes (:mod:`.scenes`). Used by the server's
start-up warm-up, the benchmarks, the demo-sequence generator and the tests."""
