"""moepeak's version (also moepeak.__version__), a module of its own so that any module
can read it without the package facade."""
__version__ = "0.1.0"
