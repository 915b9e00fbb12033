"""Inference servers for ``actor.backend: server``: vLLM servers driven token-in/token-out over HTTP.

Modules: :mod:`.client` (the actors' backend), :mod:`.launch` (``vllm serve`` with worldloop's
extension, what ``worldloop serve`` runs), :mod:`.extension` (the vLLM worker extension: weights
from the ZeroMQ channel, the log-prob convention), :mod:`.app` (the API-server middleware: loads
versions between requests, ``/worldloop/info``, heartbeat), :mod:`.fingerprint` (what must agree
between a server and the learner's model). Only :mod:`.extension`, :mod:`.app` and :mod:`.launch`
import vLLM; an actor needs none of it.
"""
