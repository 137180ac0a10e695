"""The caller's side: decorators, handles, arguments and what the API returns."""
