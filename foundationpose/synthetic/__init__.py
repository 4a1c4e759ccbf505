"""Synthetic data that needs no files: procedural meshes (:mod:`.meshes`), a box mesh built with
Pillow only (:mod:`.pillow_box`), small RGB-D scenes (:mod:`.scenes`), sensor-like depth (:mod:`.sensor`) and
tracking scenarios with ground truth (:mod:`.scenarios`), and the object suite of textured real-object shapes
(:mod:`.objects`, built from :mod:`.primitives` and :mod:`.prints`). Used by the server's start-up warm-up, the benchmarks,
the demo-sequence generator, evaluation and the tests."""
