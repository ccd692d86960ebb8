{{M}} = arith.maximumf {{ACC}}, {{A}} : f32
