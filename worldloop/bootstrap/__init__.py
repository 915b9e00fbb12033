"""Making the model a run starts from: (config) -> (model directory).

``store`` is the entry point (:func:`worldloop.bootstrap.store.prepare_model`, what ``worldloop
up`` calls before any process starts, and ``worldloop model build|resolve``): an existing
``model.path``, else the warm start of the config's recipe, shipped in ``worldloop/warmstarts/``,
cached in ``$XDG_CACHE_HOME/worldloop/models``, or built there now. ``recipe`` says what in the
config and the code decides that model (the recipe hash, the fingerprints of ``recipe.json``).
``pipeline`` runs the steps of a build in order, each a module of its own that reads no config:

1. ``tiny_model``: the embedded tiny Qwen2.5-VL (tokenizer trained locally, random init, optional
   copy pre-training), built offline in seconds;
2. ``grounding``: its grounding pre-training (describe a board from its image);
3. ``sft``: the supervised warm start on solver demonstrations.
"""
