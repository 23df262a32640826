"""The toy video world: the toy shapes, moving (docs/toy-video-world.md)."""
