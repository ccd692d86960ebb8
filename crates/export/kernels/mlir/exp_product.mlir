{{DIFF}} = arith.subf {{S}}, {{MAX}} : f32
{{E}} = math.exp {{DIFF}} : f32
{{P}} = arith.mulf {{E}}, {{X}} : f32
{{ACC1}} = arith.addf {{ACC}}, {{P}} : f32
{{SUM1}} = arith.addf {{SUM}}, {{E}} : f32
