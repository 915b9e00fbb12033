"""``worldloop eval``: held-out evaluation of a local model, a learner checkpoint or an
OpenAI-compatible endpoint (``evaluate`` plans and runs; ``local``/``remote`` play episodes;
``model`` resolves what ``--model`` names; ``stats`` builds the Table-2 layout with intervals)."""
