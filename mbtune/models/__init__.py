"""The models a trial trains: the built-ins (``mlp``, ``cnn_bn``, ``gpt``), Hugging Face
models built from a config (``hf:<model_type>``) and user models
(``package.module:function``), each as a :class:`~mbtune.models.spec.ModelSpec`; activation
checkpointing of their blocks; the forms a batch takes and its micro-batches.

May import: mbtune.errors, mbtune.config. Imports torch (inside the trial process only:
the modules import it where they build, so that the driver can check a model's options
without it).
"""
