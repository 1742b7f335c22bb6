"""beeswarm: run one large language model across volunteer machines."""
__version__ = "0.1.0"
