"""The auth wing: who may do what, and the API tokens that say who one is.

* `roles` — the roles, the actions and the pure decision between them;
* `tokens` — tokens created, revoked, checked per request; the bootstrap token;
* `rows` — the ``api_tokens`` table in the store.
"""
