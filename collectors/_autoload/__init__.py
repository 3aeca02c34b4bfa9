"""The directory ``rtop run`` puts first on ``PYTHONPATH``: its ``sitecustomize.py``
instruments every Python process of the command (see that module). Nothing imports this
package; it is one so that the file ships with ``collectors``."""
