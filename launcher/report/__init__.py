"""Reporting: the result of a run (result.json and its exit status), its console report, its
HTML page and figures, the progress lines while it runs, and the summary and page of a sweep."""
