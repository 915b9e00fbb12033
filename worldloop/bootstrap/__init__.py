"""Making the model a run starts from: (config) -> (model directory).

``pipeline`` is the one entry point (:func:`worldloop.bootstrap.pipeline.prepare_model`, what
``worldloop up`` calls before any process starts) and runs the steps in order, each a module of
its own that reads no config:

1. ``tiny_model``: the embedded tiny Qwen2.5-VL (tokenizer trained locally, random init, optional
   copy pre-training), built offline in seconds;
2. ``grounding``: its grounding pre-training (describe a board from its image);
3. ``sft``: the supervised warm start on solver demonstrations.
"""
