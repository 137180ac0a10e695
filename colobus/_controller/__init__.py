"""The controller's parts and its facade."""
