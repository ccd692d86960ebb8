{{OUT}} = arith.mulf {{A}}, {{B}} : f32
