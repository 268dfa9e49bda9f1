"""inferbus router: picks the version of each request and forwards it, frames untouched."""
