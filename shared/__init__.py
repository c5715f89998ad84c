"""streamrl's shared package: the contracts every service imports.

Wire protocol (`protocol`), Redis key names (`keys`), the streams client (`streams`), the worker
registry (`registry`), OpenAI-compatible HTTP types (`openai_api`), config loading (`config`),
logging (`logs`), metrics (`metrics`) and HTTP error mapping (`http`). Nothing service-specific.
"""
