"""KV-aware router: one OpenAI-compatible front over several ``deepinfer serve`` workers.

``index.py`` (which worker holds which pages, fed by ``events.py`` from the workers' KV
events), ``prompts.py`` (a request's page hashes), ``policy.py`` (kv / round_robin /
least_load), ``workers.py`` (health, load), ``proxy.py`` (forwarding), ``app.py``.
"""
