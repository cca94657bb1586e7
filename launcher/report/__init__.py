"""Reporting: the result of a run (result.json and its exit status), its console report and heat
maps, the progress lines while it runs, and the summary of a sweep."""
