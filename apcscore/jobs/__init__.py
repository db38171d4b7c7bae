"""Jobs turn dataset records into engine requests, and engine outputs into result rows."""
