"""Test and benchmark support that ships with worldloop: a fake OpenAI-compatible endpoint
speaking the real HTTP protocol (``fake_openai``; run it as ``python -m worldloop.testing.fake_openai``)
and small valid messages (``trajectories``). Used by ``tests/`` and ``bench/``; never by a role."""
