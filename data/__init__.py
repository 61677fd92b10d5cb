"""The bundled text (``austen/``, with ``PROVENANCE.md``), installed as package data.

Read it with ``importlib.resources.files("flsmem.data")``; :mod:`flsmem.models.data`
does.
"""
