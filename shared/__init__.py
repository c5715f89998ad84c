"""streamrl's shared package: the contracts every service imports.

Wire protocol (`protocol`), the trainer's records and REST answers (`records`), the generator's
admin messages (`admin_api`), OpenAI-compatible HTTP types (`openai_api`, `responses_api`), Redis
key names (`keys`), the streams client (`streams`), the pause protocol (`pause`), the worker
registry (`registry`), the service lifecycle and probes (`service`), config loading (`config`,
`config_error`) and the run's config tree (`run_config`, composed of its owners' `sections`),
auth (`auth`), HTTP error mapping (`http`), logging (`logs`) and metrics (`metrics`). Nothing
service-specific, and nothing heavy: no module here imports torch, vLLM or transformers at import
(the gym gateway and the command line import it); the torch and vLLM code the trainer and the generator share
is in `shared_torch`.
"""
