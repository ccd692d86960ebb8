{{P}} = arith.mulf {{X}}, {{Y}} : f32
{{SUM}} = arith.addf {{ACC}}, {{P}} : f32
