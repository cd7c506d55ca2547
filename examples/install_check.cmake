# ctest install_find_package: installs the build in BUILD_DIR into WORK_DIR/prefix, then
# configures, builds and runs the examples in SOURCE_DIR as an outside project that finds that
# install with find_package(mjolnir CONFIG REQUIRED).
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "install_find_package: '${ARGN}' failed (${status}):\n${out}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
foreach(file include/mjolnir/mjolnir.h include/mjolnir/decode.h)
  if(NOT EXISTS ${WORK_DIR}/prefix/${file})
    message(FATAL_ERROR "install_find_package: ${file} was not installed")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/decode_c)
message(STATUS "install_find_package: decode_c built against the installed package and ran")
