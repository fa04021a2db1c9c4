"""The web console for operators and the portal for each tenant (see web.py)."""
