"""Pipelines around the engine (speech, images, music). Empty until the media issues land."""
